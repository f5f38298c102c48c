"""The detokenizer role: token ids in, text deltas out (incremental detokenization, stop strings)."""
