"""Training: data (embedded corpus, tokenise, pack), loop, KD loss, optimisers, checkpoints, distributed set-up."""
