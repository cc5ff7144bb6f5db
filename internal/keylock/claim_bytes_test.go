package keylock_test

import (
	"slices"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// TestClaimByteBudget: a claim reads at most its byte budget of messages
// (record keys, values and header values), plus the first message whatever
// its size. A key cut part-way keeps the first messages of its run; a key
// cut entirely is given back at once, its lease released, and both are
// claimed again, from where they stopped, by the next claim.
func TestClaimByteBudget(t *testing.T) {
	db := pgtest.NewDB(t)
	// Keys a < b < c, in claim order; sizes in bytes of value, key and header
	// values: every message of a and c is 100 bytes, b's 1,000.
	const ins = `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, key, value, header_keys, header_values)
		SELECT k, s, 't', now() - interval '1 minute', 'pending', '\x0102'::bytea, decode(repeat('ab', n - 6), 'hex'),
		       '{h,i}', ARRAY['\x01'::bytea, '\x020304'::bytea]
		FROM (VALUES ('a', 1, 100), ('a', 2, 100), ('a', 3, 100), ('b', 4, 1000), ('b', 5, 1000), ('c', 6, 100)) AS v (k, s, n)`
	tests := []struct {
		name     string
		maxBytes int
		want     []string // claimSummary of the first claim
		wantNext []string // of a second claim with no budget to speak of
	}{
		{name: "everything fits", maxBytes: 1 << 20, want: []string{"a:1,2,3", "b:4,5", "c:6"}},
		{name: "the first message comes whatever its size", maxBytes: 1,
			want: []string{"a:1"}, wantNext: []string{"a:2"}},
		{name: "a key cut part-way keeps a prefix of its run", maxBytes: 150,
			want: []string{"a:1,2"}, wantNext: []string{"a:3"}},
		{name: "a key past the budget is given back", maxBytes: 300,
			want: []string{"a:1,2,3"}, wantNext: []string{"b:4"}},
		{name: "the row that crosses the budget comes, the next does not", maxBytes: 301,
			want: []string{"a:1,2,3", "b:4"}, wantNext: []string{"b:5"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reset(t, db.Pool)
			mustExec(t, db.Pool, ins)
			l, err := keylock.New(db.Pool, keylock.Config{Owner: "one", Lease: time.Minute, PerKey: 10, MaxBytes: tt.maxBytes})
			if err != nil {
				t.Fatal(err)
			}
			claims, err := l.Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if got := claimSummary(t, claims); !slices.Equal(got, tt.want) {
				t.Fatalf("claim within %d bytes = %q, want %q", tt.maxBytes, got, tt.want)
			}
			if got := keylock.Bytes(claims); got > max(tt.maxBytes, 100)+1000 {
				t.Errorf("claim holds %d bytes, budget %d", got, tt.maxBytes)
			}
			// Keys given back are free at once.
			for _, k := range []string{"a", "b", "c"} {
				held := false
				for _, c := range claims {
					held = held || c.BusinessKey == k
				}
				if l := leaseOf(t, db.Pool, k); l.Found && !held && l.By != nil {
					t.Errorf("key %s was not claimed but is leased: %s", k, l)
				}
			}
			if tt.wantNext == nil {
				return
			}
			// Publish what the first claim read and give the keys back: the
			// next claim starts where the budget cut.
			var published []int64
			for _, c := range claims {
				for _, m := range c.Messages {
					published = append(published, m.ID)
				}
			}
			if err := l.Finalize(t.Context(), claims, keylock.Outcome{Published: published}); err != nil {
				t.Fatal(err)
			}
			tight, err := keylock.New(db.Pool, keylock.Config{Owner: "two", Lease: time.Minute, PerKey: 10, MaxBytes: 1})
			if err != nil {
				t.Fatal(err)
			}
			next, err := tight.Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if got := claimSummary(t, next); !slices.Equal(got, tt.wantNext) {
				t.Errorf("next claim within 1 byte = %q, want %q", got, tt.wantNext)
			}
			assertHeadsMatch(t, db.Pool)
		})
	}
}
