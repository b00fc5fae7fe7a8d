"""What a sweep produces: study summaries with confidence intervals, the cross-study report, visuals."""
