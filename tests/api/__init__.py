"""Every way clients reach the ring: the HTTP routes (OpenAI, Anthropic Messages, Responses, SGLang's native,
operator routes), the protocol's parameters, the Python Engine/Client and `ringserve submit`, and the soak."""
