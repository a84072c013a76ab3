"""The generation engine: scheduler, KV cache and paged attention, the model runner, sampler, tokenizer and weight quantisation."""
