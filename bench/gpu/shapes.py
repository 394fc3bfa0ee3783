"""Config fields of real models' shapes, for random-weight models on a lent GPU machine (only
small files reach it): bench/gpu/gpu_steps.py, bench/gpu/gpu_profile.py, bench/gpu/synthetic_models.py."""

LLAMA_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
QWEN = {"model_type": "qwen2", "vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
LLAMA = {"model_type": "llama", "vocab_size": 128256, "rope_theta": 500000.0, "rope_scaling": LLAMA_ROPE,
         "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

SHAPES = {
    "qwen2.5-0.5b": {**QWEN, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2},
    # A draft for the host's CPU beside a GPU target: 45M weights of body (three of the 0.5B's layers),
    # which with a reduced output layer (--draft-vocab) reads ~75 MB a step in int8.
    "qwen2.5-0.5b-3l": {**QWEN, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 3,
                        "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2.5-1.5b": {**QWEN, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2},
    "qwen2.5-14b": {**QWEN, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
                    "num_attention_heads": 40, "num_key_value_heads": 8},
    "qwen2.5-32b": {**QWEN, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8},
    "llama3.2-1b": {**LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64},
    "llama3.1-8b": {**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
}
