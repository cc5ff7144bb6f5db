package opscli

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/deferq/scheduler/internal/operate"
)

// table prints aligned columns.
type table struct{ tw *tabwriter.Writer }

// newTable starts a table on w with a header row, if given.
func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)}
	if len(header) > 0 {
		t.row(header...)
	}
	return t
}

func (t *table) row(cells ...string) { fmt.Fprintln(t.tw, strings.Join(cells, "\t")) }

func (t *table) flush() { t.tw.Flush() }

// messageColumns and messageCells are how every command prints messages.
func messageColumns() []string {
	return []string{"ID", "KEY", "SEQ", "TARGET", "STATE", "DUE", "ATTEMPT", "REASON"}
}

func messageCells(m operate.Message) []string {
	return []string{
		strconv.FormatInt(m.ID, 10), printable(orDash(m.BusinessKey), false), strconv.FormatInt(m.Seq, 10),
		printable(orDash(m.TargetTopic), false), m.State, dueCell(m), strconv.Itoa(int(m.Attempt)),
		printable(orDash(m.Reason), false),
	}
}

// dueCell is a message's due time, or - for a rejected one, which never
// comes due (its next_run_at is only what the record asked for).
func dueCell(m operate.Message) string {
	if m.State == "rejected" {
		return "-"
	}
	return formatTime(m.NextRunAt)
}

func printMessages(w io.Writer, ms []operate.Message) {
	t := newTable(w, messageColumns()...)
	for _, m := range ms {
		t.row(messageCells(m)...)
	}
	t.flush()
}

// formatTime prints a time in the operator's time zone, to the second.
func formatTime(t time.Time) string { return t.Local().Format(time.RFC3339) }

func formatTimePtr(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return formatTime(*t)
}

// relative says how far t is from now: "in 5m0s", "3s ago".
func relative(t, now time.Time) string {
	d := t.Sub(now)
	switch {
	case d > -time.Second && d < time.Second:
		return "now"
	case d > 0:
		return "in " + humanDuration(d)
	default:
		return humanDuration(-d) + " ago"
	}
}

// humanDuration rounds d for reading: to the second above a second, to the
// millisecond below.
func humanDuration(d time.Duration) string {
	if d >= time.Second {
		return d.Round(time.Second).String()
	}
	return d.Round(time.Millisecond).String()
}

func orDash(s *string) string {
	if s == nil {
		return "-"
	}
	return *s
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func plural[N int | int32 | int64](n N, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// printable makes s safe to print on a terminal: control and other
// non-printing characters become Go escapes, so that a header or a payload
// cannot move the cursor, clear the screen or break a table's columns. With
// multiline, newlines and tabs stay as they are.
func printable(s string, multiline bool) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case multiline && (r == '\n' || r == '\t'):
			b.WriteRune(r)
		case unicode.IsPrint(r):
			b.WriteRune(r)
		default:
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		}
	}
	return b.String()
}

// previewOf cuts a decoded value (see show_message.sql: UTF-8 text, or \x
// and hex) to its first n bytes of data, a text one on a character boundary.
func previewOf(s, encoding *string, n int) (*string, bool) {
	if s == nil || encoding == nil {
		return s, false
	}
	v := *s
	switch *encoding {
	case "hex":
		if len(v) <= 2+2*n {
			return s, false
		}
		v = v[:2+2*n]
	default:
		if len(v) <= n {
			return s, false
		}
		for n > 0 && !utf8.RuneStart(v[n]) {
			n--
		}
		v = v[:n]
	}
	return &v, true
}
