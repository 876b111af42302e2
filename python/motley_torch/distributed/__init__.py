"""How ranks work together: joining the job and its process groups (`groups`), the 1F1B
pipeline and the per-segment gradient rings (`pipeline`), and the one gradient-sync seam
(`gradient_sync`) with its ways: overlapped buckets (`overlap`) and ZeRO-1 (`zero`).
"""
