"""The training goal: a layout's memory, step time and traffic, its report, and the published runs it is checked against."""
