"""The reports of a verification: report.json, report.md, report.html with its charts and
junit.xml, written as one set into a checked report folder."""
