"""conveyor: a small, fast LLM inference engine.

    from conveyor import LLM, SamplingParams
    llm = LLM()                       # the default model, SmolLM2-135M-Instruct
    print(llm.generate(["Hello"], SamplingParams(max_tokens=20))[0].outputs[0].text)
"""
from conveyor.shared.lora import LoRARequest
from conveyor.shared.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "Client", "AsyncClient", "__version__"]


def __getattr__(name: str):
    # The engine pulls in torch; import it only when asked for, so `import conveyor` stays light.
    if name == "LLM":
        from conveyor.llm import LLM
        return LLM
    if name in ("Client", "AsyncClient"):
        from conveyor import client
        return getattr(client, name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
