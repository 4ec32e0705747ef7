"""kiln.evaluate.tasks"""
