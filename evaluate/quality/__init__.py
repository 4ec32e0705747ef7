"""kiln.evaluate.quality"""
