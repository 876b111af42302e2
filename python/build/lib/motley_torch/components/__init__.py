"""What a training run is made of: checkpoints, data (datasets on disk, the step's tokens, a
plan's split), precision, the lines a run prints, a stage built and written out, export.
"""
