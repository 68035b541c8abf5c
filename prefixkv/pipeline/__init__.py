"""Multi-stage pipelines in the spirit of vLLM-Omni: each stage is its own engine (or a head over
the previous stage's hidden states) with its own prefix cache, and a stage hands its token ids,
text and final hidden states to the next.

stages.py    StageOutput, LLMStage (generate or embed, on its own prefixkv engine), HeadStage
pipeline.py  Pipeline: runs the stages in order, each stage's inputs built from the previous
             stage's outputs by a connector function (vLLM-Omni's custom_process_input_func)
"""

from .pipeline import Pipeline
from .stages import HeadStage, LLMStage, StageOutput

__all__ = ["HeadStage", "LLMStage", "Pipeline", "StageOutput"]
