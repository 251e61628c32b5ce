"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` / ``tool_calls`` over the model's own chat
template and tool-call format (``tidespec.structured.tool_calls``), the grammar that enforces ``required`` and a named
function, and the streaming of calls (``stream``). Only the chat route uses it.
"""
