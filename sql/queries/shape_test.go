package queries

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/deferq/scheduler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// pgTypes maps each Go type the layer uses to the Postgres types it may
// stand for. A pointer stands for the same types as its element (nullness
// is not in Postgres's description of a statement, so it is not checked).
var pgTypes = map[reflect.Type][]string{
	reflect.TypeFor[string]():                       {"text", "varchar"},
	reflect.TypeFor[bool]():                         {"bool"},
	reflect.TypeFor[int32]():                        {"int4"},
	reflect.TypeFor[int64]():                        {"int8"},
	reflect.TypeFor[int]():                          {"int4", "int8"},
	reflect.TypeFor[float64]():                      {"float8"},
	reflect.TypeFor[time.Time]():                    {"timestamptz"},
	reflect.TypeFor[time.Duration]():                {"interval"},
	reflect.TypeFor[[]byte]():                       {"bytea"},
	reflect.TypeFor[[]string]():                     {"_text", "_varchar"},
	reflect.TypeFor[[]int32]():                      {"_int4"},
	reflect.TypeFor[[]int64]():                      {"_int8"},
	reflect.TypeFor[[]bool]():                       {"_bool"},
	reflect.TypeFor[[]time.Time]():                  {"_timestamptz"},
	reflect.TypeFor[[]time.Duration]():              {"_interval"},
	reflect.TypeFor[[][]byte]():                     {"_bytea"},
	reflect.TypeFor[pgtype.FlatArray[*string]]():    {"_text", "_varchar"},
	reflect.TypeFor[pgtype.FlatArray[*int64]]():     {"_int8"},
	reflect.TypeFor[pgtype.FlatArray[*time.Time]](): {"_timestamptz"},
	reflect.TypeFor[pgtype.FlatArray[[]byte]]():     {"_bytea"},
}

// fields flattens a struct's fields, embedded structs in place.
func fields(t reflect.Type) []reflect.StructField {
	var out []reflect.StructField
	for f := range t.Fields() {
		if f.Anonymous && f.Type.Kind() == reflect.Struct {
			for _, inner := range fields(f.Type) {
				inner.Index = append(slices.Clone(f.Index), inner.Index...)
				out = append(out, inner)
			}
			continue
		}
		out = append(out, f)
	}
	return out
}

// accepts reports whether Go type t may carry Postgres type pg.
func accepts(t reflect.Type, pg string) bool {
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return slices.Contains(pgTypes[t], pg)
}

// shapeProblems compares a statement's Go types with Postgres's description
// of it and lists every difference, each naming the file, the parameter or
// column and the Go type, so that a statement edited without its types
// says what to add where.
func shapeProblems(s Statement, desc *pgconn.StatementDescription, typeName func(uint32) string) []string {
	var problems []string
	add := func(format string, args ...any) {
		problems = append(problems, s.File+": "+fmt.Sprintf(format, args...))
	}
	params := fields(s.Params)
	for i, oid := range desc.ParamOIDs {
		if i >= len(params) {
			add("$%d (%s) has no field in %s, which has %d", i+1, typeName(oid), s.Params.Name(), len(params))
			continue
		}
		if pg := typeName(oid); !accepts(params[i].Type, pg) {
			add("$%d is %s, %s.%s is %s", i+1, pg, s.Params.Name(), params[i].Name, params[i].Type)
		}
	}
	for _, f := range params[min(len(params), len(desc.ParamOIDs)):] {
		add("%s.%s has no parameter: the statement has %d", s.Params.Name(), f.Name, len(desc.ParamOIDs))
	}
	if s.Row == nil {
		for i, col := range desc.Fields {
			add("column %d %q (%s) has no Row type to go to", i+1, col.Name, typeName(col.DataTypeOID))
		}
		return problems
	}
	cols := fields(s.Row)
	for i, col := range desc.Fields {
		pg := typeName(col.DataTypeOID)
		if i >= len(cols) {
			add("column %d %q (%s) has no field in %s, which has %d", i+1, col.Name, pg, s.Row.Name(), len(cols))
			continue
		}
		f := cols[i]
		if tag := f.Tag.Get("db"); tag != col.Name {
			add("column %d is %q, %s.%s is tagged %q", i+1, col.Name, s.Row.Name(), f.Name, tag)
		}
		if !accepts(f.Type, pg) {
			add("column %q is %s, %s.%s is %s", col.Name, pg, s.Row.Name(), f.Name, f.Type)
		}
	}
	for _, f := range cols[min(len(cols), len(desc.Fields)):] {
		add("%s.%s (%q) has no column: the statement returns %d", s.Row.Name(), f.Name, f.Tag.Get("db"), len(desc.Fields))
	}
	return problems
}

// orderProblems checks that args and dest follow field order: args must
// return each field's value in turn and dest each field's address.
func orderProblems(s Statement) []string {
	var problems []string
	p := reflect.New(s.Params).Elem()
	params := fields(s.Params)
	for i, f := range params {
		p.FieldByIndex(f.Index).Set(sample(f.Type, i))
	}
	args := p.Interface().(interface{ args() []any }).args()
	if len(args) != len(params) {
		problems = append(problems, fmt.Sprintf("%s.args returns %d values for %d fields", s.Params.Name(), len(args), len(params)))
	}
	for i := range min(len(args), len(params)) {
		if want := p.FieldByIndex(params[i].Index).Interface(); !reflect.DeepEqual(args[i], want) {
			problems = append(problems, fmt.Sprintf("%s.args()[%d] is not field %s", s.Params.Name(), i, params[i].Name))
		}
	}
	if s.Row == nil {
		return problems
	}
	r := reflect.New(s.Row)
	dest := r.Interface().(interface{ dest() []any }).dest()
	cols := fields(s.Row)
	if len(dest) != len(cols) {
		problems = append(problems, fmt.Sprintf("%s.dest returns %d pointers for %d fields", s.Row.Name(), len(dest), len(cols)))
	}
	for i := range min(len(dest), len(cols)) {
		if dest[i] != r.Elem().FieldByIndex(cols[i].Index).Addr().Interface() {
			problems = append(problems, fmt.Sprintf("%s.dest()[%d] is not &%s", s.Row.Name(), i, cols[i].Name))
		}
	}
	return problems
}

// sample makes a value of t that differs for every i, so a swapped pair of
// arguments shows.
func sample(t reflect.Type, i int) reflect.Value {
	v := reflect.New(t).Elem()
	switch t.Kind() {
	case reflect.String:
		v.SetString(fmt.Sprintf("field %d", i))
	case reflect.Int, reflect.Int32, reflect.Int64:
		v.SetInt(int64(1000 + i))
	case reflect.Float64:
		v.SetFloat(float64(1000 + i))
	case reflect.Bool:
		v.SetBool(i%2 == 0)
	case reflect.Pointer:
		v.Set(reflect.New(t.Elem()))
		v.Elem().Set(sample(t.Elem(), i))
	case reflect.Slice:
		v.Set(reflect.MakeSlice(t, 1, 1))
		v.Index(0).Set(sample(t.Elem(), i))
	case reflect.Uint8:
		v.SetUint(uint64(i))
	case reflect.Struct:
		if t == reflect.TypeFor[time.Time]() {
			v.Set(reflect.ValueOf(time.Unix(int64(i), 0)))
		}
	}
	return v
}

// TestStatementShapes prepares every statement on a migrated database and
// compares Postgres's description of it with its Go types: parameters by
// count and type, columns by count, name and type, and args and dest by
// field order.
func TestStatementShapes(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewDB(t)
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	typeName := typeNamer(conn.Conn())
	for _, s := range Statements() {
		t.Run(s.File, func(t *testing.T) {
			desc, err := conn.Conn().PgConn().Prepare(ctx, "", s.SQL, nil)
			if err != nil {
				t.Fatalf("prepare: %v", err)
			}
			for _, p := range append(shapeProblems(s, desc, typeName), orderProblems(s)...) {
				t.Error(p)
			}
		})
	}
}

func typeNamer(conn *pgx.Conn) func(uint32) string {
	return func(oid uint32) string {
		if tp, ok := conn.TypeMap().TypeForOID(oid); ok {
			return tp.Name
		}
		return fmt.Sprintf("oid %d", oid)
	}
}

// TestShapeCheckFindsMistakes gives the checks statements with the mistakes
// they exist to catch and expects each to be named.
func TestShapeCheckFindsMistakes(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewDB(t)
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	typeName := typeNamer(conn.Conn())

	type twoInts struct{ A, B int64 }
	type textThenInt struct {
		A string
		B int64
	}
	type oneCol struct {
		N int64 `db:"n"`
	}
	type twoCols struct {
		M int64 `db:"m"`
		N int64 `db:"n"`
	}
	type wrongName struct {
		N int64 `db:"m"`
	}
	type wrongType struct {
		N string `db:"n"`
	}
	tests := []struct {
		name   string
		sql    string
		params any
		row    any
		want   string
	}{
		{"right", "SELECT $1::bigint + $2::bigint AS n", twoInts{}, oneCol{}, ""},
		{"a parameter too few", "SELECT $1::bigint + $2::bigint + $3::bigint AS n", twoInts{}, oneCol{}, "a parameter too few: $3 (int8) has no field in twoInts, which has 2"},
		{"a parameter too many", "SELECT $1::bigint AS n", twoInts{}, oneCol{}, "twoInts.B has no parameter: the statement has 1"},
		{"a parameter's type", "SELECT $1::bigint + $2::bigint AS n", textThenInt{}, oneCol{}, "$1 is int8, textThenInt.A is string"},
		{"a column's name", "SELECT $1::bigint + $2::bigint AS n", twoInts{}, wrongName{}, `column 1 is "n", wrongName.N is tagged "m"`},
		{"a column's type", "SELECT $1::bigint + $2::bigint AS n", twoInts{}, wrongType{}, `column "n" is int8, wrongType.N is string`},
		{"a column too many", "SELECT $1::bigint + $2::bigint AS n, 1::int AS m", twoInts{}, oneCol{}, `column 2 "m" (int4) has no field in oneCol, which has 1`},
		{"a column too few", "SELECT $1::bigint + $2::bigint AS m", twoInts{}, twoCols{}, `twoCols.N ("n") has no column: the statement returns 1`},
		{"a column without a Row", "SELECT $1::bigint + $2::bigint AS n", twoInts{}, nil, `column 1 "n" (int8) has no Row type to go to`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := Statement{File: tt.name, SQL: tt.sql, Params: reflect.TypeOf(tt.params)}
			if tt.row != nil {
				s.Row = reflect.TypeOf(tt.row)
			}
			desc, err := conn.Conn().PgConn().Prepare(ctx, "", s.SQL, nil)
			if err != nil {
				t.Fatal(err)
			}
			got := strings.Join(shapeProblems(s, desc, typeName), "; ")
			if tt.want == "" && got != "" || !strings.Contains(got, tt.want) {
				t.Errorf("problems %q, want %q", got, tt.want)
			}
		})
	}
}

// swapped lists its arguments out of field order, as a hand edit might.
type swapped struct{ A, B int64 }

func (p swapped) args() []any { return []any{p.B, p.A} }

type swappedRow struct {
	A int64 `db:"a"`
	B int64 `db:"b"`
}

func (r *swappedRow) dest() []any { return []any{&r.B, &r.A} }

func TestOrderCheckFindsSwaps(t *testing.T) {
	got := strings.Join(orderProblems(Statement{Params: reflect.TypeFor[swapped](), Row: reflect.TypeFor[swappedRow]()}), "; ")
	for _, want := range []string{"swapped.args()[0] is not field A", "swappedRow.dest()[0] is not &A"} {
		if !strings.Contains(got, want) {
			t.Errorf("problems %q, want one with %q", got, want)
		}
	}
	for _, s := range Statements() {
		if p := orderProblems(s); len(p) > 0 {
			t.Errorf("%s: %v", s.File, p)
		}
	}
}

// TestEveryFileIsAStatement: every .sql file here is embedded and listed in
// Statements once, so none runs without its shape checked.
func TestEveryFileIsAStatement(t *testing.T) {
	onDisk, err := filepath.Glob("*.sql")
	if err != nil {
		t.Fatal(err)
	}
	var embedded, listed []string
	for name, text := range files() {
		embedded = append(embedded, name)
		disk, err := os.ReadFile(name)
		if err != nil || string(disk) != text {
			t.Errorf("%s: the embedded text is not the file's (%v)", name, err)
		}
	}
	for _, s := range Statements() {
		listed = append(listed, s.File)
		if s.SQL == "" {
			t.Errorf("%s: listed without text", s.File)
		}
	}
	for _, name := range onDisk {
		if !slices.Contains(embedded, name) {
			t.Errorf("%s is not embedded: add a //go:embed variable and its entry in files (queries.go)", name)
		}
		if !slices.Contains(listed, name) {
			t.Errorf("%s has no entry in Statements: give it its Params and Row types and list them there", name)
		}
	}
	for _, name := range embedded {
		if !slices.Contains(onDisk, name) {
			t.Errorf("%s is embedded but not a file here", name)
		}
	}
	slices.Sort(listed)
	if dup := slices.Compact(slices.Clone(listed)); len(dup) != len(listed) {
		t.Errorf("Statements lists a file more than once: %v", listed)
	}
}
