"""kiln.engine"""
