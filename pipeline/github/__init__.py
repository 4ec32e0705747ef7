"""GitHub Actions: the pull-request report and the job matrix of changed recipes."""
