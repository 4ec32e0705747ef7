"""kiln.pipeline"""
