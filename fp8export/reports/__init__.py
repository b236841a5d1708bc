"""Reports of a verification: report.json, report.md, report.html with its charts, junit.xml."""
