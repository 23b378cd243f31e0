"""The detokenizer actor: token ids per scheduler step -> text deltas per request."""
