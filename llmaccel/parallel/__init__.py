"""Running one model on several ranks of a torch.distributed group."""
