// Package operate runs the operator runbook (sql/runbook) from Go, for the
// operator commands (internal/opscli) and the console (internal/console)
// alike, so that both do exactly what the runbook files say an operator
// does with psql: Statements binds a file's psql variables, Rows runs a
// one-statement file and scans its rows into the typed rows of rows.go, and
// ExplainDBError and ExplainNoSchema turn the database's errors into what an
// operator should do.
package operate
