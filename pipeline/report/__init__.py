"""A run's report: Markdown, HTML, JSON and plots, and where each is published."""
