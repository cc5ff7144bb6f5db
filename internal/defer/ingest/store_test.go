package ingest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/highwater"
	"github.com/deferq/scheduler/internal/pgtest"
)

// storeTopic is the source topic the store tests write under.
const storeTopic = "scheduler.defer"

// storedRow is one deferred_message row as the tests read it back.
type storedRow struct {
	ID          int64
	Topic       string
	Partition   int32
	Offset      int64
	BusinessKey *string
	Seq         int64
	Target      *string
	NextRunAt   time.Time
	CreatedAt   time.Time
	Attempt     int32
	State       string
	Reason      *string
	ErrorClass  *string
	ErrorMsg    *string
	OriginID    *int64
	Key, Value  []byte
	// KeyNull and ValueNull are what SQL says about NULL, to check the
	// nil/empty distinction independently of how the driver scans.
	KeyNull, ValueNull bool
	HeaderKeys         []string
	HeaderValues       [][]byte
	HeaderValueNulls   []bool
	// Head reports whether deferred_key holds this row as a head.
	Head bool
}

// readRows returns the rows matching the SQL condition where, ordered by
// source coordinates.
func readRows(t testing.TB, pool *pgxpool.Pool, where string, args ...any) []storedRow {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := pool.Query(ctx, `
SELECT m.id, m.source_topic, m.source_partition, m.source_offset, m.business_key, m.seq, m.target_topic,
       m.next_run_at, m.created_at, m.attempt, m.state, m.reason, m.error_class, m.error_message, m.origin_id,
       m.key, m.value, m.key IS NULL, m.value IS NULL, m.header_keys, m.header_values,
       ARRAY(SELECT v IS NULL FROM unnest(m.header_values) WITH ORDINALITY AS u (v, i) ORDER BY i),
       EXISTS (SELECT 1 FROM deferred_key k WHERE k.head_id = m.id)
FROM deferred_message m
WHERE `+where+`
ORDER BY m.source_topic, m.source_partition, m.source_offset`, args...)
	if err != nil {
		t.Fatalf("read rows: %v", err)
	}
	defer rows.Close()
	var out []storedRow
	for rows.Next() {
		var r storedRow
		if err := rows.Scan(&r.ID, &r.Topic, &r.Partition, &r.Offset, &r.BusinessKey, &r.Seq, &r.Target,
			&r.NextRunAt, &r.CreatedAt, &r.Attempt, &r.State, &r.Reason, &r.ErrorClass, &r.ErrorMsg, &r.OriginID,
			&r.Key, &r.Value, &r.KeyNull, &r.ValueNull, &r.HeaderKeys, &r.HeaderValues,
			&r.HeaderValueNulls, &r.Head); err != nil {
			t.Fatalf("scan row: %v", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("read rows: %v", err)
	}
	return out
}

// countRows returns the number of deferred_message rows.
func countRows(t testing.TB, pool *pgxpool.Pool) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_message").Scan(&n); err != nil {
		t.Fatalf("count rows: %v", err)
	}
	return n
}

// dbNow returns the database clock, the one next_run_at is computed with.
func dbNow(t testing.TB, pool *pgxpool.Pool) time.Time {
	t.Helper()
	var now time.Time
	if err := pool.QueryRow(context.Background(), "SELECT now()").Scan(&now); err != nil {
		t.Fatalf("read database clock: %v", err)
	}
	return now
}

func ptr[T any](v T) *T { return &v }

// insertNext stores entries after the partition's stored position, whatever
// it is: for tests of what Insert stores rather than of the continuity check.
func insertNext(ctx context.Context, t testing.TB, store *Store, topic string, partition int32, entries []Entry) (Inserted, error) {
	t.Helper()
	got, err := store.Positions(ctx, topic, []int32{partition})
	if err != nil {
		t.Fatal(err)
	}
	pos := Position{Topic: topic, Partition: partition, Next: NoPosition}
	if sp, ok := got[partition]; ok {
		pos = sp.Position
	}
	return store.Insert(ctx, pos, entries)
}

func fmtPtr[T any](p *T) string {
	if p == nil {
		return "NULL"
	}
	return fmt.Sprintf("%q", fmt.Sprint(*p))
}

// fmtBytes shows nil as NULL so that nil and empty differ in messages.
func fmtBytes(b []byte) string {
	if b == nil {
		return "NULL"
	}
	return fmt.Sprintf("%q", b)
}

// hdr builds a header; a nil value stays nil (a null header value).
func hdr(key string, value []byte) protocol.Header {
	return protocol.Header{Key: []byte(key), Value: value}
}

// rowWant is what one stored row must hold. Seq 0 means "fresh from the
// sequence". A zero At means next_run_at is created_at plus Delay (the
// database clock at insert), less at most waited: the time the record
// waited in ingest after it was read, which comes off its delay (0 for
// rows written by the Store directly).
type rowWant struct {
	bizKey       *string
	seq          int64
	target       *string
	at           time.Time
	delay        time.Duration
	waited       time.Duration
	attempt      int32
	state        string
	reason       *string
	class, msg   *string
	origin       *int64
	key, value   []byte
	headerKeys   []string
	headerValues [][]byte
	head         bool
}

func checkRow(t *testing.T, name string, got storedRow, want rowWant) {
	t.Helper()
	errorf := func(format string, args ...any) {
		t.Helper()
		t.Errorf("%s (offset %d): "+format, append([]any{name, got.Offset}, args...)...)
	}
	if !reflect.DeepEqual(got.BusinessKey, want.bizKey) {
		errorf("business_key %s, want %s", fmtPtr(got.BusinessKey), fmtPtr(want.bizKey))
	}
	if want.seq != 0 && got.Seq != want.seq {
		errorf("seq %d, want %d (kept from defer.seq)", got.Seq, want.seq)
	}
	if !reflect.DeepEqual(got.Target, want.target) {
		errorf("target_topic %s, want %s", fmtPtr(got.Target), fmtPtr(want.target))
	}
	if !want.at.IsZero() {
		if !got.NextRunAt.Equal(want.at) {
			errorf("next_run_at %v, want exactly %v", got.NextRunAt, want.at)
		}
	} else if d := got.NextRunAt.Sub(got.CreatedAt); d > want.delay || d < want.delay-want.waited {
		errorf("next_run_at - created_at = %v, want %v less at most %v (delay from the database clock, counted from the read)", d, want.delay, want.waited)
	}
	if got.Attempt != want.attempt {
		errorf("attempt %d, want %d", got.Attempt, want.attempt)
	}
	if got.State != want.state {
		errorf("state %q, want %q", got.State, want.state)
	}
	if !reflect.DeepEqual(got.Reason, want.reason) {
		errorf("reason %s, want %s", fmtPtr(got.Reason), fmtPtr(want.reason))
	}
	if !reflect.DeepEqual(got.ErrorClass, want.class) {
		errorf("error_class %s, want %s", fmtPtr(got.ErrorClass), fmtPtr(want.class))
	}
	if !reflect.DeepEqual(got.ErrorMsg, want.msg) {
		errorf("error_message %s, want %s", fmtPtr(got.ErrorMsg), fmtPtr(want.msg))
	}
	if !reflect.DeepEqual(got.OriginID, want.origin) {
		errorf("origin_id %s, want %s", fmtPtr(got.OriginID), fmtPtr(want.origin))
	}
	checkBytes := func(what string, got []byte, gotNull bool, want []byte) {
		t.Helper()
		if gotNull != (want == nil) || !bytes.Equal(got, want) || (got == nil) != (want == nil) {
			errorf("%s %s (SQL NULL: %v), want %s", what, fmtBytes(got), gotNull, fmtBytes(want))
		}
	}
	checkBytes("key", got.Key, got.KeyNull, want.key)
	checkBytes("value", got.Value, got.ValueNull, want.value)
	wantKeys := want.headerKeys
	if wantKeys == nil {
		wantKeys = []string{}
	}
	if !reflect.DeepEqual(got.HeaderKeys, wantKeys) {
		errorf("header_keys %q, want %q", got.HeaderKeys, wantKeys)
	}
	if len(got.HeaderValues) != len(want.headerValues) || len(got.HeaderValueNulls) != len(want.headerValues) {
		errorf("%d header values (%d null flags), want %d", len(got.HeaderValues), len(got.HeaderValueNulls), len(want.headerValues))
	} else {
		for i, w := range want.headerValues {
			checkBytes(fmt.Sprintf("header value %d", i+1), got.HeaderValues[i], got.HeaderValueNulls[i], w)
		}
	}
	if got.Head != want.head {
		errorf("is a deferred_key head: %v, want %v", got.Head, want.head)
	}
}

func TestStoreInsertColumns(t *testing.T) {
	db := pgtest.NewDB(t)
	store := NewStore(db.Pool, nil)
	ctx := context.Background()

	at := time.Date(2031, 2, 3, 4, 5, 6, 123456000, time.UTC) // microseconds: what timestamptz keeps
	past := time.Date(2001, 9, 9, 1, 46, 40, 0, time.UTC)
	target := "orders.created"
	tooLong := &protocol.RejectError{Code: "delay_too_long", Detail: `defer.delay "48h" is more than the maximum delay 24h0m0s`}
	noTarget := &protocol.RejectError{Code: "missing_target", Detail: "defer.target is absent"}
	binary := []byte{0xff, 0x00, 0xfe, 0x80}

	tests := []struct {
		name  string
		entry Entry // Offset is set from the position in the batch
		want  rowWant
	}{
		{
			name: "ordered with delay",
			entry: Entry{
				Record:   protocol.Record{Key: []byte("order-1"), Value: []byte("payload-1"), Headers: []protocol.Header{hdr(protocol.HeaderTarget, []byte(target)), hdr(protocol.HeaderDelay, []byte("30s"))}},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "order-1", Ordered: true, Delay: 30 * time.Second},
			},
			want: rowWant{bizKey: ptr("order-1"), target: &target, delay: 30 * time.Second, state: "pending",
				key: []byte("order-1"), value: []byte("payload-1"),
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay}, headerValues: [][]byte{[]byte(target), []byte("30s")}, head: true},
		},
		{
			name: "defer.at is kept exactly",
			entry: Entry{
				Record:   protocol.Record{Key: []byte("order-2"), Value: []byte("v")},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "order-2", Ordered: true, HasAt: true, At: at},
			},
			want: rowWant{bizKey: ptr("order-2"), target: &target, at: at, state: "pending", key: []byte("order-2"), value: []byte("v"), head: true},
		},
		{
			name: "defer.at in the past is kept as is",
			entry: Entry{
				Record:   protocol.Record{Key: []byte("order-3"), Value: []byte("v")},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "order-3", Ordered: true, HasAt: true, At: past},
			},
			want: rowWant{bizKey: ptr("order-3"), target: &target, at: past, state: "pending", key: []byte("order-3"), value: []byte("v"), head: true},
		},
		{
			name: "zero delay is due at insert",
			entry: Entry{
				Record:   protocol.Record{Key: []byte("order-4"), Value: []byte("v")},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "order-4", Ordered: true},
			},
			want: rowWant{bizKey: ptr("order-4"), target: &target, state: "pending", key: []byte("order-4"), value: []byte("v"), head: true},
		},
		{
			name: "sub-millisecond delay",
			entry: Entry{
				Record:   protocol.Record{Key: []byte("order-4b"), Value: []byte("v")},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "order-4b", Ordered: true, Delay: 1500*time.Millisecond + 250*time.Microsecond},
			},
			want: rowWant{bizKey: ptr("order-4b"), target: &target, delay: 1500*time.Millisecond + 250*time.Microsecond, state: "pending",
				key: []byte("order-4b"), value: []byte("v"), head: true},
		},
		{
			name: "unordered: business key ignored unless Ordered",
			entry: Entry{
				Record:   protocol.Record{Key: nil, Value: []byte("v")},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "not-used", Delay: time.Minute},
			},
			want: rowWant{target: &target, delay: time.Minute, state: "pending", value: []byte("v"), head: true},
		},
		{
			name: "re-deferral keeps seq, origin, attempt and error",
			entry: Entry{
				Record: protocol.Record{Key: []byte("order-5"), Value: []byte("v")},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "order-5", Ordered: true, Delay: time.Hour,
					Attempt: 3, ErrorClass: "java.net.SocketTimeoutException", ErrorMessage: "read timed out ✓", OriginID: 42, Seq: 7},
			},
			want: rowWant{bizKey: ptr("order-5"), seq: 7, target: &target, delay: time.Hour, attempt: 3, state: "pending",
				class: ptr("java.net.SocketTimeoutException"), msg: ptr("read timed out ✓"), origin: ptr[int64](42),
				key: []byte("order-5"), value: []byte("v"), head: true},
		},
		{
			name: "nil key and value are NULL",
			entry: Entry{
				Record:   protocol.Record{Key: nil, Value: nil},
				Schedule: protocol.Schedule{Target: target, Delay: time.Second},
			},
			want: rowWant{target: &target, delay: time.Second, state: "pending", head: true},
		},
		{
			name: "empty key and value are empty, not NULL",
			entry: Entry{
				Record:   protocol.Record{Key: []byte{}, Value: []byte{}},
				Schedule: protocol.Schedule{Target: target, Delay: time.Second},
			},
			want: rowWant{target: &target, delay: time.Second, state: "pending", key: []byte{}, value: []byte{}, head: true},
		},
		{
			name: "binary key and value byte for byte",
			entry: Entry{
				Record:   protocol.Record{Key: binary, Value: []byte{0, 1, 2, 0xff, 0xc3, 0x28}},
				Schedule: protocol.Schedule{Target: target, BusinessKey: protocol.Text(binary), Ordered: true, Delay: time.Second},
			},
			want: rowWant{bizKey: ptr(`\xff00fe80`), target: &target, delay: time.Second, state: "pending",
				key: binary, value: []byte{0, 1, 2, 0xff, 0xc3, 0x28}, head: true},
		},
		{
			name: "headers: order, duplicates, binary, null and empty values",
			entry: Entry{
				Record: protocol.Record{Key: []byte("order-6"), Value: []byte("v"), Headers: []protocol.Header{
					hdr("trace", []byte("t1")),
					hdr("b", nil),
					hdr("trace", []byte("t2")),
					hdr("bin", binary),
					hdr("empty", []byte{}),
					hdr(protocol.HeaderTarget, []byte(target)),
					hdr("a", []byte("last")),
				}},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "order-6", Ordered: true, Delay: time.Second},
			},
			want: rowWant{bizKey: ptr("order-6"), target: &target, delay: time.Second, state: "pending", key: []byte("order-6"), value: []byte("v"),
				headerKeys:   []string{"trace", "b", "trace", "bin", "empty", protocol.HeaderTarget, "a"},
				headerValues: [][]byte{[]byte("t1"), nil, []byte("t2"), binary, {}, []byte(target), []byte("last")},
				head:         true},
		},
		{
			name: "rejected keeps what was parsed, is due at ingest and is no head",
			entry: Entry{
				Record:   protocol.Record{Key: []byte("order-9"), Value: []byte("bad"), Headers: []protocol.Header{hdr(protocol.HeaderDelay, []byte("48h"))}},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "order-9", Ordered: true, Delay: 48 * time.Hour, Attempt: 2},
				Reject:   tooLong,
			},
			want: rowWant{bizKey: ptr("order-9"), target: &target, attempt: 2, state: "rejected", reason: ptr(tooLong.Error()),
				key: []byte("order-9"), value: []byte("bad"),
				headerKeys: []string{protocol.HeaderDelay}, headerValues: [][]byte{[]byte("48h")}},
		},
		{
			// Same key as the rejected row before it, with a later seq: it
			// must be the key's head, since a rejected row is never one.
			name: "pending after a rejected row of the same key",
			entry: Entry{
				Record:   protocol.Record{Key: []byte("order-9"), Value: []byte("good")},
				Schedule: protocol.Schedule{Target: target, BusinessKey: "order-9", Ordered: true, Delay: time.Second},
			},
			want: rowWant{bizKey: ptr("order-9"), target: &target, delay: time.Second, state: "pending", key: []byte("order-9"), value: []byte("good"), head: true},
		},
		{
			name: "rejected without target",
			entry: Entry{
				Record:   protocol.Record{Key: []byte("rej-only"), Value: nil},
				Schedule: protocol.Schedule{BusinessKey: "rej-only", Ordered: true},
				Reject:   noTarget,
			},
			want: rowWant{bizKey: ptr("rej-only"), state: "rejected", reason: ptr(noTarget.Error()), key: []byte("rej-only")},
		},
	}

	entries := make([]Entry, len(tests))
	for i, tt := range tests {
		entries[i] = tt.entry
		entries[i].Offset = int64(100 + i)
	}
	before := dbNow(t, db.Pool)
	n, err := insertNext(ctx, t, store, storeTopic, 2, entries)
	if err != nil {
		t.Fatalf("Insert: %v", err)
	}
	after := dbNow(t, db.Pool)
	if n != (Inserted{Stored: int64(len(entries)), Rejected: 2}) {
		t.Errorf("Insert = %+v, want %d stored, 2 of them rejected, none parked", n, len(entries))
	}

	rows := readRows(t, db.Pool, "true")
	if len(rows) != len(tests) {
		t.Fatalf("table holds %d rows, want %d", len(rows), len(tests))
	}
	var lastFresh int64
	for i, tt := range tests {
		got := rows[i]
		t.Run(tt.name, func(t *testing.T) {
			if got.Topic != storeTopic || got.Partition != 2 || got.Offset != entries[i].Offset {
				t.Errorf("source %s/%d/%d, want %s/2/%d", got.Topic, got.Partition, got.Offset, storeTopic, entries[i].Offset)
			}
			if got.CreatedAt.Before(before) || got.CreatedAt.After(after) {
				t.Errorf("created_at %v not within the insert (%v .. %v)", got.CreatedAt, before, after)
			}
			checkRow(t, tt.name, got, tt.want)
		})
		if tt.want.seq == 0 {
			// Fresh seqs increase in offset order within the batch.
			if got.Seq <= lastFresh {
				t.Errorf("%s: fresh seq %d not above the previous fresh seq %d", tt.name, got.Seq, lastFresh)
			}
			lastFresh = got.Seq
		}
	}

	// A key whose only row is rejected has no head at all.
	var heads int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM deferred_key WHERE business_key = 'rej-only'").Scan(&heads); err != nil {
		t.Fatal(err)
	}
	if heads != 0 {
		t.Errorf("deferred_key holds %d heads for a key with only a rejected row, want 0", heads)
	}
}

// TestStoreInsertSeqOrder checks that fresh seqs follow offset order across a
// batch big enough for the planner to hash and reorder, with headers on most
// records and re-deferrals (explicit seq) interleaved.
func TestStoreInsertSeqOrder(t *testing.T) {
	db := pgtest.NewDB(t)
	store := NewStore(db.Pool, nil)

	const n = 3000
	entries := make([]Entry, n)
	explicit := map[int64]int64{}
	for i := range entries {
		off := int64(i)
		e := Entry{
			Offset:   off,
			Record:   protocol.Record{Key: fmt.Appendf(nil, "k-%d", i%37), Value: []byte("v")},
			Schedule: protocol.Schedule{Target: "orders.created", BusinessKey: fmt.Sprintf("k-%d", i%37), Ordered: true, Delay: time.Minute},
		}
		for j := range i % 4 {
			e.Record.Headers = append(e.Record.Headers, hdr(fmt.Sprintf("h%d", j), fmt.Appendf(nil, "%d/%d", i, j)))
		}
		if i%10 == 3 {
			e.Schedule.Seq = int64(1_000_000 + i)
			explicit[off] = e.Schedule.Seq
		}
		entries[i] = e
	}
	got, err := insertNext(context.Background(), t, store, storeTopic, 0, entries)
	if err != nil {
		t.Fatalf("Insert: %v", err)
	}
	if got.Stored != n {
		t.Fatalf("Insert stored %d, want %d", got.Stored, n)
	}
	rows := readRows(t, db.Pool, "true")
	if len(rows) != n {
		t.Fatalf("table holds %d rows, want %d", len(rows), n)
	}
	var last int64
	for i, r := range rows {
		if r.Offset != int64(i) {
			t.Fatalf("row %d has offset %d", i, r.Offset)
		}
		if want, ok := explicit[r.Offset]; ok {
			if r.Seq != want {
				t.Errorf("offset %d: seq %d, want the explicit %d", r.Offset, r.Seq, want)
			}
			continue
		}
		if r.Seq <= last {
			t.Fatalf("offset %d: fresh seq %d not above %d of the previous fresh record: seq does not follow offset order", r.Offset, r.Seq, last)
		}
		last = r.Seq
		if len(r.HeaderKeys) != i%4 {
			t.Fatalf("offset %d: %d headers, want %d", r.Offset, len(r.HeaderKeys), i%4)
		}
		for j := range r.HeaderKeys {
			if r.HeaderKeys[j] != fmt.Sprintf("h%d", j) || string(r.HeaderValues[j]) != fmt.Sprintf("%d/%d", i, j) {
				t.Fatalf("offset %d: header %d is %q=%q: headers went to the wrong record", r.Offset, j, r.HeaderKeys[j], r.HeaderValues[j])
			}
		}
	}
}

func TestStoreInsertIdempotent(t *testing.T) {
	type batch struct {
		topic     string
		partition int32
		offsets   []int64
		value     string // distinguishes a replay from the original
		want      int64  // stored
	}
	span := func(from, to int64) []int64 {
		var o []int64
		for i := from; i <= to; i++ {
			o = append(o, i)
		}
		return o
	}
	tests := []struct {
		name    string
		batches []batch
		rows    int64
	}{
		{
			name: "same batch twice",
			batches: []batch{
				{storeTopic, 0, span(0, 9), "first", 10},
				{storeTopic, 0, span(0, 9), "replay", 0},
			},
			rows: 10,
		},
		{
			name: "overlapping batches store only the new records",
			batches: []batch{
				{storeTopic, 0, span(0, 9), "first", 10},
				{storeTopic, 0, span(5, 14), "replay", 5},
				{storeTopic, 0, span(0, 20), "replay", 6},
			},
			rows: 21,
		},
		{
			name: "one replayed record inside a new batch",
			batches: []batch{
				{storeTopic, 1, []int64{7}, "first", 1},
				{storeTopic, 1, span(5, 9), "replay", 4},
			},
			rows: 5,
		},
		{
			name: "same offsets on other partitions and topics are other records",
			batches: []batch{
				{storeTopic, 0, span(0, 4), "first", 5},
				{storeTopic, 1, span(0, 4), "first", 5},
				{"other.defer", 0, span(0, 4), "first", 5},
				{storeTopic, 0, span(0, 4), "replay", 0},
			},
			rows: 15,
		},
		{
			name: "the same offset twice in one batch",
			batches: []batch{
				{storeTopic, 0, []int64{0, 1, 1, 2}, "first", 3},
			},
			rows: 3,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			store := NewStore(db.Pool, nil)
			for i, b := range tt.batches {
				entries := make([]Entry, len(b.offsets))
				for j, off := range b.offsets {
					entries[j] = Entry{
						Offset:   off,
						Record:   protocol.Record{Key: []byte("k"), Value: []byte(b.value), Headers: []protocol.Header{hdr("n", []byte(b.value))}},
						Schedule: protocol.Schedule{Target: "orders.created", BusinessKey: "k", Ordered: true, Delay: time.Minute},
					}
				}
				n, err := insertNext(context.Background(), t, store, b.topic, b.partition, entries)
				if err != nil {
					t.Fatalf("batch %d: Insert: %v", i+1, err)
				}
				if n.Stored != b.want {
					t.Errorf("batch %d (%s/%d offsets %v): stored %d, want %d", i+1, b.topic, b.partition, b.offsets, n.Stored, b.want)
				}
			}
			if n := countRows(t, db.Pool); n != tt.rows {
				t.Errorf("table holds %d rows, want %d", n, tt.rows)
			}
			// What was stored first stays as it was: a replay changes nothing.
			seen := map[string]bool{}
			for _, b := range tt.batches {
				if b.value != "first" {
					continue
				}
				for _, off := range b.offsets {
					k := fmt.Sprintf("%s/%d/%d", b.topic, b.partition, off)
					if seen[k] {
						continue
					}
					seen[k] = true
					rows := readRows(t, db.Pool, "source_topic = $1 AND source_partition = $2 AND source_offset = $3", b.topic, b.partition, off)
					if len(rows) != 1 {
						t.Errorf("%s: %d rows, want 1", k, len(rows))
						continue
					}
					if string(rows[0].Value) != "first" || !reflect.DeepEqual(rows[0].HeaderKeys, []string{"n"}) {
						t.Errorf("%s: value %q headers %q after replay, want the original", k, rows[0].Value, rows[0].HeaderKeys)
					}
				}
			}
			// Exactly one head for the one key, whatever was replayed.
			var heads int
			if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_key WHERE business_key = 'k'").Scan(&heads); err != nil {
				t.Fatal(err)
			}
			if heads != 1 {
				t.Errorf("deferred_key holds %d heads for key k, want 1", heads)
			}
		})
	}

	t.Run("empty batch", func(t *testing.T) {
		// No database needed: nothing to store is not an error.
		n, err := (&Store{}).Insert(context.Background(), Position{Topic: storeTopic, Next: NoPosition}, nil)
		if n != (Inserted{}) || err != nil {
			t.Errorf("Insert of no entries = %+v, %v; want nothing, nil", n, err)
		}
	})
}

// TestStoreRejectedHeaderKeys checks that header keys Postgres text cannot
// hold are kept, in Text form, on the rejected row.
func TestStoreRejectedHeaderKeys(t *testing.T) {
	rules := protocol.Rules{Targets: protocol.TargetPatterns{"orders.*"}, MaxDelay: 24 * time.Hour}
	tests := []struct {
		name    string
		headers []protocol.Header
		wantKey []string // header_keys as stored
	}{
		{
			name:    "not UTF-8",
			headers: []protocol.Header{hdr(protocol.HeaderTarget, []byte("orders.created")), {Key: []byte{0xff, 0xfe, 'x'}, Value: []byte("v")}, hdr(protocol.HeaderDelay, []byte("1s"))},
			wantKey: []string{protocol.HeaderTarget, `\xfffe78`, protocol.HeaderDelay},
		},
		{
			name:    "NUL byte",
			headers: []protocol.Header{{Key: []byte("a\x00b"), Value: nil}, hdr(protocol.HeaderTarget, []byte("orders.created")), hdr(protocol.HeaderDelay, []byte("1s"))},
			wantKey: []string{`\x610062`, protocol.HeaderTarget, protocol.HeaderDelay},
		},
		{
			name: "invalid UTF-8 sequence and a valid twin",
			headers: []protocol.Header{hdr(protocol.HeaderTarget, []byte("orders.created")), hdr(protocol.HeaderDelay, []byte("1s")),
				{Key: []byte{0xc3, 0x28}, Value: []byte{0xc3, 0x28}}, hdr("é", []byte("ok"))},
			wantKey: []string{protocol.HeaderTarget, protocol.HeaderDelay, `\xc328`, "é"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			rec := protocol.Record{Key: []byte("order-1"), Value: []byte("v"), Headers: tt.headers}
			sc, err := protocol.Parse(rec, rules, time.Now())
			var rej *protocol.RejectError
			if !errors.As(err, &rej) {
				t.Fatalf("Parse = %v, want a *protocol.RejectError", err)
			}
			if rej.Code != "invalid_encoding" {
				t.Fatalf("Parse rejected with %q, want invalid_encoding", rej.Code)
			}
			n, err := NewStore(db.Pool, nil).Insert(context.Background(), Position{Topic: storeTopic, Next: NoPosition}, []Entry{{Offset: 5, Record: rec, Schedule: sc, Reject: rej}})
			if err != nil {
				t.Fatalf("Insert: %v", err)
			}
			if n != (Inserted{Stored: 1, Rejected: 1}) {
				t.Fatalf("Insert = %+v, want 1 stored, rejected", n)
			}
			rows := readRows(t, db.Pool, "true")
			if len(rows) != 1 {
				t.Fatalf("%d rows, want 1", len(rows))
			}
			r := rows[0]
			if r.State != "rejected" || r.Reason == nil || *r.Reason != rej.Error() {
				t.Errorf("state %q reason %s, want rejected with %q", r.State, fmtPtr(r.Reason), rej.Error())
			}
			if !strings.HasPrefix(*r.Reason, "invalid_encoding: ") {
				t.Errorf("reason %q does not start with the code", *r.Reason)
			}
			if !reflect.DeepEqual(r.HeaderKeys, tt.wantKey) {
				t.Errorf("header_keys %q, want %q", r.HeaderKeys, tt.wantKey)
			}
			for i, h := range tt.headers {
				if got := r.HeaderKeys[i]; got != protocol.Text(h.Key) {
					t.Errorf("header key %d stored as %q, want protocol.Text(key) %q", i+1, got, protocol.Text(h.Key))
				}
				if !bytes.Equal(r.HeaderValues[i], h.Value) || r.HeaderValueNulls[i] != (h.Value == nil) {
					t.Errorf("header value %d stored as %s, want %s", i+1, fmtBytes(r.HeaderValues[i]), fmtBytes(h.Value))
				}
			}
			if r.Head {
				t.Error("the rejected row is a deferred_key head")
			}
		})
	}
}

// The partition's position is stored with its rows, and a batch is stored
// only after the position its writer last saw: a position that moved (the
// database went back, another writer stored past it, a new epoch) makes
// Insert store nothing and say so.
func TestStorePositions(t *testing.T) {
	ctx := context.Background()
	entries := func(from, to int64) []Entry {
		var es []Entry
		for o := from; o <= to; o++ {
			es = append(es, Entry{Offset: o, Record: protocol.Record{Value: []byte("v")},
				Schedule: protocol.Schedule{Target: "orders.retry", Delay: time.Hour}})
		}
		return es
	}
	at := func(next int64, epoch int32) Position {
		return Position{Topic: storeTopic, Partition: 2, Epoch: epoch, Next: next}
	}
	type step struct {
		pos     Position
		from    int64 // offsets from..to
		to      int64
		moved   bool // want ErrPositionMoved
		stored  int64
		wantPos Position // the stored position after the step
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"first batch, then the next", []step{
			{pos: at(NoPosition, 0), from: 0, to: 4, stored: 5, wantPos: at(5, 0)},
			{pos: at(5, 0), from: 5, to: 9, stored: 5, wantPos: at(10, 0)},
		}},
		{"a gap in offsets (compaction, transaction markers) is no move", []step{
			{pos: at(NoPosition, 0), from: 0, to: 4, stored: 5, wantPos: at(5, 0)},
			{pos: at(5, 0), from: 8, to: 9, stored: 2, wantPos: at(10, 0)},
		}},
		{"a writer expecting no position finds one", []step{
			{pos: at(NoPosition, 0), from: 0, to: 4, stored: 5, wantPos: at(5, 0)},
			{pos: at(NoPosition, 0), from: 5, to: 9, moved: true, wantPos: at(5, 0)},
		}},
		{"the position went back under the writer", []step{
			{pos: at(NoPosition, 0), from: 0, to: 4, stored: 5, wantPos: at(5, 0)},
			{pos: at(9, 0), from: 9, to: 12, moved: true, wantPos: at(5, 0)},
		}},
		{"another writer stored past it", []step{
			{pos: at(NoPosition, 0), from: 0, to: 9, stored: 10, wantPos: at(10, 0)},
			{pos: at(5, 0), from: 5, to: 9, moved: true, wantPos: at(10, 0)},
		}},
		{"another epoch", []step{
			{pos: at(NoPosition, 0), from: 0, to: 4, stored: 5, wantPos: at(5, 0)},
			{pos: at(5, 1), from: 5, to: 9, moved: true, wantPos: at(5, 0)},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			store := NewStore(db.Pool, nil)
			for i, st := range tt.steps {
				before := countRows(t, db.Pool)
				n, err := store.Insert(ctx, st.pos, entries(st.from, st.to))
				if st.moved {
					if !errors.Is(err, ErrPositionMoved) {
						t.Fatalf("step %d: Insert after %v = %v, want ErrPositionMoved", i+1, st.pos, err)
					}
					if after := countRows(t, db.Pool); after != before {
						t.Errorf("step %d: %d rows stored by a refused batch", i+1, after-before)
					}
				} else if err != nil || n.Stored != st.stored {
					t.Fatalf("step %d: Insert after %v = %+v, %v; want %d stored", i+1, st.pos, n, err, st.stored)
				}
				got, err := store.Positions(ctx, storeTopic, []int32{1, 2, 3})
				if err != nil {
					t.Fatal(err)
				}
				if len(got) != 1 || got[2].Position != st.wantPos {
					t.Fatalf("step %d: Positions = %+v, want only partition 2 at %v", i+1, got, st.wantPos)
				}
			}
		})
	}
}

// A partition re-created in Kafka reuses offsets: under a new epoch, a
// record at an offset stored before is a new record, not a duplicate.
func TestStoreEpochTellsReusedOffsets(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := NewStore(db.Pool, nil)
	batch := func(v string) []Entry {
		return []Entry{{Offset: 0, Record: protocol.Record{Value: []byte(v)}, Schedule: protocol.Schedule{Target: "orders.retry", Delay: time.Hour}},
			{Offset: 1, Record: protocol.Record{Value: []byte(v)}, Schedule: protocol.Schedule{Target: "orders.retry", Delay: time.Hour}}}
	}
	old := Position{Topic: storeTopic, Partition: 0, Next: NoPosition}
	if n, err := store.Insert(ctx, old, batch("old")); err != nil || n.Stored != 2 {
		t.Fatalf("Insert of the old topic's records = %+v, %v", n, err)
	}
	old.Next = 2
	reset := Position{Topic: storeTopic, Partition: 0, Epoch: 1, Next: 0}
	if err := store.SetPosition(ctx, old, reset, "new-topic-id"); err != nil {
		t.Fatalf("SetPosition to the new epoch: %v", err)
	}
	// The same move again finds the position moved: nothing changes twice.
	if err := store.SetPosition(ctx, old, reset, "new-topic-id"); !errors.Is(err, ErrPositionMoved) {
		t.Fatalf("second SetPosition = %v, want ErrPositionMoved", err)
	}
	if n, err := store.Insert(ctx, reset, batch("new")); err != nil || n.Stored != 2 {
		t.Fatalf("Insert of the new topic's records at the same offsets = %+v, %v; want 2 stored", n, err)
	}
	var epochs []int32
	rows, err := db.Pool.Query(ctx, "SELECT source_epoch FROM deferred_message WHERE source_offset = 0 ORDER BY source_epoch")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var e int32
		if err := rows.Scan(&e); err != nil {
			t.Fatal(err)
		}
		epochs = append(epochs, e)
	}
	if len(epochs) != 2 || epochs[0] != 0 || epochs[1] != 1 {
		t.Errorf("rows at offset 0 have epochs %v, want [0 1]", epochs)
	}
	got, err := store.Positions(ctx, storeTopic, []int32{0})
	if err != nil {
		t.Fatal(err)
	}
	want := StoredPosition{Position: Position{Topic: storeTopic, Partition: 0, Epoch: 1, Next: 2}, TopicID: "new-topic-id"}
	if got[0] != want {
		t.Errorf("Positions = %+v, want %+v", got[0], want)
	}
	// SetPosition creates a position where none is stored, once.
	none := Position{Topic: storeTopic, Partition: 5, Next: NoPosition}
	if err := store.SetPosition(ctx, none, Position{Topic: storeTopic, Partition: 5, Next: 7}, ""); err != nil {
		t.Fatalf("SetPosition creating a position: %v", err)
	}
	if err := store.SetPosition(ctx, none, Position{Topic: storeTopic, Partition: 5, Next: 9}, ""); !errors.Is(err, ErrPositionMoved) {
		t.Fatalf("SetPosition creating it again = %v, want ErrPositionMoved", err)
	}
}

// A database that went back in time draws ids and seqs again that messages
// published since carried. Insert moves both sequences past the highest the
// process has seen before it draws any, and raises the marks to what it
// stored; marks the sequences are already past change nothing.
func TestStoreInsertKeepsSequencesPastMarks(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewDB(t)
	marks := &highwater.Marks{}
	store := NewStore(db.Pool, marks)
	entry := func(off int64) []Entry {
		return []Entry{{Offset: off, Record: protocol.Record{Value: []byte("v")}, Schedule: protocol.Schedule{Target: "orders.retry", BusinessKey: "k", Ordered: true, Delay: time.Hour}}}
	}
	idSeq := func(off int64) (int64, int64) {
		t.Helper()
		var id, seq int64
		if err := db.Pool.QueryRow(ctx, "SELECT id, seq FROM deferred_message WHERE source_offset = $1", off).Scan(&id, &seq); err != nil {
			t.Fatal(err)
		}
		return id, seq
	}
	pos := Position{Topic: storeTopic, Partition: 0, Next: NoPosition}
	if _, err := store.Insert(ctx, pos, entry(0)); err != nil {
		t.Fatal(err)
	}
	id0, seq0 := idSeq(0)
	if id, seq := marks.Get(); id != id0 || seq != seq0 {
		t.Errorf("marks after an insert = %d, %d; want the stored row's %d, %d", id, seq, id0, seq0)
	}
	pos.Next = 1
	if _, err := store.Insert(ctx, pos, entry(1)); err != nil {
		t.Fatal(err)
	}
	if id, seq := idSeq(1); id != id0+1 || seq != seq0+1 {
		t.Errorf("next row = %d, %d; want %d, %d: marks the sequences are past move nothing", id, seq, id0+1, seq0+1)
	}
	// What a process remembers of ids handed out before the database went back.
	marks.Observe(5000, 7000)
	pos.Next = 2
	if _, err := store.Insert(ctx, pos, entry(2)); err != nil {
		t.Fatal(err)
	}
	if id, seq := idSeq(2); id <= 5000 || seq <= 7000 {
		t.Errorf("row stored after marks 5000, 7000 = %d, %d; want both past the marks", id, seq)
	}
}

// BenchmarkStoreInsert stores batches of typical first deferrals: one
// partition's batch of 6, 50, 200 and 1,000 records, and 64 partitions'
// batches of 6 in one statement (what ingest's writer combines when a live
// stream is spread over many partitions), each through both paths: COPY
// (path=copy) and the INSERT statement (path=statement). us/rec compares
// them: a statement's fixed cost is paid once per batch, or once for the
// 64; COPY's round trips cost a small batch more than its rows save, which
// sets copyMinRecords. Its time is mostly Postgres's; its allocations per
// batch (-benchmem) are the service's own cost of encoding the batch, and
// do not depend on the machine.
func BenchmarkStoreInsert(b *testing.B) {
	for _, tc := range []struct {
		name             string
		partitions, size int
	}{
		{"batch=6", 1, 6},
		{"batch=50", 1, 50},
		{"batch=200", 1, 200},
		{"batch=1000", 1, 1000},
		{"64_partitions_x6_in_one_statement", 64, 6},
	} {
		for _, viaCopy := range []bool{true, false} {
			path := "path=statement"
			if viaCopy {
				path = "path=copy"
			}
			b.Run(path+"/"+tc.name, func(b *testing.B) {
				db := pgtest.NewDB(b)
				store := NewStore(db.Pool, nil)
				rules := ingestRules()
				batches := make([]Batch, tc.partitions)
				for p := range batches {
					batches[p] = Batch{Pos: Position{Topic: "scheduler.defer", Partition: int32(p), Next: NoPosition},
						Entries: make([]Entry, tc.size)}
				}
				var offset int64
				b.ReportAllocs()
				for b.Loop() {
					for p := range batches {
						for i := range batches[p].Entries {
							// A typical first deferral: six headers, one of them
							// the producer's own, and its own business key.
							key := fmt.Sprintf("order-%d-%d", p, offset+int64(i))
							rec := protocol.Record{
								Key:   []byte(key),
								Value: []byte(`{"order_id":1234567,"status":"created"}`),
								Headers: hs("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
									protocol.HeaderTarget, "orders.created", protocol.HeaderDelay, "30s", protocol.HeaderKey, key,
									protocol.HeaderErrorClass, "TimeoutException", protocol.HeaderErrorMessage, "inventory service: deadline exceeded after 5s"),
							}
							sc, err := protocol.Parse(rec, rules, time.Now())
							if err != nil {
								b.Fatal(err)
							}
							batches[p].Entries[i] = Entry{Offset: offset + int64(i), Record: rec, Schedule: sc}
						}
					}
					var out []BatchResult
					var err error
					if viaCopy {
						out, err = store.copyBatches(b.Context(), "scheduler.defer", batches)
					} else {
						out, err = store.insertBatches(b.Context(), "scheduler.defer", tc.partitions*tc.size, batches)
					}
					if err != nil {
						b.Fatal(err)
					}
					offset += int64(tc.size)
					for p := range batches {
						if out[p].Err != nil || out[p].Stored != int64(tc.size) {
							b.Fatalf("partition %d: stored %d, %v", p, out[p].Stored, out[p].Err)
						}
						batches[p].Pos.Next = offset
					}
				}
				b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*tc.partitions*tc.size), "us/rec")
			})
		}
	}
}
