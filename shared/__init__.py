"""tether.shared: model, tokenizer, KV cache, sampling and wire codecs used by both the server and the edge client."""
