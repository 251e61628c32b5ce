"""tidespec: an inference engine whose speculative decoding is lossless, load-adaptive and learns while it serves.

The public API (what ``from tidespec import ...`` offers); everything else is reached through its
package. Importing it loads the engine and the drafters, never online training, the server or
plotting.

Worked example::

    from tidespec import LLM, EngineConfig, SamplingParams
    llm = LLM(EngineConfig())                                   # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32))[0]
    print(out.text)
"""

from tidespec.config import EngineConfig
from tidespec.errors import UserError
from tidespec.llm import LLM
from tidespec.sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "UserError"]
