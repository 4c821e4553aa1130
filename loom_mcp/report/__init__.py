"""Reports: campaign JSON, Markdown and plots."""
