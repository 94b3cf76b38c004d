"""Model converters applied to a built model before anything holds its parameters (torchtitan's pattern):
``fp8`` (torchao float8 training, Bridge's ``mixed_precision``) and ``lora`` (LoRA adapters, Bridge's ``peft``)."""
