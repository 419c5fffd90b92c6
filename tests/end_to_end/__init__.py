"""End to end: user workflows across packages (Accelerate's examples and no_trainer scripts, torchrig's examples, PEFT/QLoRA, the GPU tier)."""
