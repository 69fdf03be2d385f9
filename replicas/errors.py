"""Errors the engine raises for bad requests (the API layer maps them to HTTP 400)."""


class InvalidRequestError(ValueError):
    """A request the engine refuses before doing any work: the message says what and where;
    ``param`` names the request field at fault when there is one (``kv_budget``, ``prompt``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GrammarCompileError(InvalidRequestError):
    """A grammar (JSON schema, regex, EBNF, tools) that cannot be compiled, with xgrammar's message,
    or whose compilation ran past the time bound."""


class GrammarCompileLimitError(GrammarCompileError):
    """A grammar whose compilation passed the compiler's time or memory bound, or killed the
    compiler process: not a verdict on the grammar (another backend is not tried after it)."""
