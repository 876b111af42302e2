"""Tools beside the library: the layer profiler (`python -m motley_torch.profile`), the GPU
check (`python/gpu-check`), activation bytes counted.
"""
