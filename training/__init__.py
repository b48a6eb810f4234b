"""memfit training: fine-tune or pretrain a causal LM with AMP, activation checkpointing and LoRA/QLoRA."""
