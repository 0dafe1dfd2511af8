"""Weight sources: reading, dequantizing and laying out model weights."""
