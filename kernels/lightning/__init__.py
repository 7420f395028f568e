"""Lightning attention: linear attention with a constant per-head decay (MiniMax, Ling / Bailing)."""
