"""The message bus: subject scheme, typed wire messages, msgpack codec, NATS connection, embedded server.

Nothing here imports torch or any device code.
"""
