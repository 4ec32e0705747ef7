"""kiln.evaluate"""
