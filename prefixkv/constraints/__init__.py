"""Everything that constrains or biases sampling, per request: `logit_bias`, `allowed_token_ids`,
`bad_words` and the grammar of structured outputs, applied to one sequence's logits row
(token_constraints.py: `RequestConstraints`); the user's `StructuredOutputsParams`
(structured_params.py); the grammar engine, xgrammar (grammar.py). The engine builds one
`RequestConstraints` per sequence when it is added; the model runner's sampler applies it, and the
output processor advances its grammar on each accepted token.

Only the torch-free parameter class is imported here: `import prefixkv` must stay light.
"""

from .structured_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
