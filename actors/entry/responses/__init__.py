"""OpenAI's Responses API: `/v1/responses` bodies parsed onto the chat path, its routes and stored responses,
and the output items and stream events of an answer."""
