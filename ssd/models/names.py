"""Names the loader (ssd/models/loader.py), the GGUF reader and the store share, kept apart
from them so that the options and the command line read them without loading torch.

How a model's weights are held:

- "gguf": its GGUF file's own blocks (CPU; ssd/kernels/quant_cpu.py), the default for a GGUF
  on a CPU;
- "dequantized": a copy in the compute dtype (fp32 on CPU: the values transformers loads);
- "q4_0": a GGUF model's blocks, each matrix stored with more than 5 bits a weight requantised
  to Q4_0 (4.5) at load (CPU; for a draft, whose numerics change only the acceptance: fewer
  bytes a token to read, so a cheaper draft step);
- "int8": weight-only int8 requantised from those values (for a draft: only acceptance changes).
"""
WEIGHTS = ("auto", "gguf", "q4_0", "dequantized", "int8")
QUANTIZATIONS = ("gguf", "q4_0", "int8")  # what a draft may be requantised to (SpecOptions.draft_quantization)
GGUF_LINK = "model.gguf"  # in a model folder: the GGUF file its weights are read from
