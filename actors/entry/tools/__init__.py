"""Tool calling on the chat path, for every API: the request's tools and choice (`ToolPlan`), the grammar that
enforces a call, and the calls read out of the answer (the model families' parsers are in `tool_parsers/`)."""
