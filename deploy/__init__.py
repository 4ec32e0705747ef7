"""kiln.deploy"""
