"""The errors a user can cause. All are ValueError subclasses so callers can catch one type;
the CLI turns them into one line on stderr and exit code 2."""


class SSDError(ValueError):
    """Base class for every user-facing error of the engine."""


class ModelNotFoundError(SSDError):
    """A model name is not in the store and is not a folder or a .gguf file."""


class ModelFileError(SSDError):
    """Model files are missing, corrupt (sha256 mismatch) or unreadable."""


class UnsupportedModelError(SSDError):
    """The model's architecture is not one the engine implements."""


class PromptError(SSDError):
    """The prompt is empty, not a string or a well-formed chat, or longer than the context."""


class ContextLengthError(PromptError):
    """The prompt and max_tokens together do not fit in the context (OpenAI's
    "context_length_exceeded")."""


class SamplingParamsError(SSDError):
    """A sampling value is out of range."""


class VocabularyMismatchError(SSDError):
    """A draft model whose vocabulary differs from the target's."""


class GrammarError(SamplingParamsError):
    """A JSON schema, regex or grammar that is malformed or cannot be compiled."""


class RankError(SSDError):
    """A tensor-parallel rank could not start, died, or broke the link: the model is gone
    with it (each rank holds only a share of it)."""
