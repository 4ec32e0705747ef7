"""kiln.pipeline.gate"""
