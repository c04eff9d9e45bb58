"""ferryman: run Mixture-of-Experts LLMs bigger than your GPU."""

from ferryman.engine.outputs import RequestOutput
from ferryman.llm import LLM
from ferryman.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
