"""Pieces shared by several actors: model file resolution and the per-process actor runtime."""
