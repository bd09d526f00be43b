"""Generation with the KV cache: the next-token logits of growing sequences (logits), sampling,
beam search, and text in and out (text)."""
