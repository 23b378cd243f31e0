"""Anthropic's Messages API: `/v1/messages` bodies onto the chat path, its answers, stream events and errors in
Anthropic's shapes, and its routes."""
