"""The hunyuan_image family: HunyuanImage 2.1 (base, distilled) text-to-image; its record, trainer, loaders, key layout, fixture and variant configs."""
