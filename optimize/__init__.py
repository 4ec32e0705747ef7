"""kiln.optimize"""
