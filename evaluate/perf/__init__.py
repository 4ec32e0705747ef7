"""kiln.evaluate.perf"""
