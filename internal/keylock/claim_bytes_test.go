package keylock_test

import (
	"slices"
	"strings"
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

// TestClaimKeepsItsClaimsWhenGivingBackFails: when giving back the keys the
// byte budget cut entirely fails, the claim still returns what it leased,
// with the error, so that the caller publishes it; dropped, those messages
// would wait out the lease unpublished. The failure is real: a trigger the
// test adds refuses the release of one of the cut keys.
func TestClaimKeepsItsClaimsWhenGivingBackFails(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, key, value)
		SELECT k, s, 't', now() - interval '1 minute', 'pending', convert_to(k, 'UTF8'), decode(repeat('ab', 100), 'hex')
		FROM (VALUES ('a', 1), ('a', 2), ('b', 3), ('c', 4)) AS v (k, s)`)
	mustExec(t, db.Pool, `CREATE FUNCTION refuse_release() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'injected: release of key % refused', OLD.business_key; END $$`)
	mustExec(t, db.Pool, `CREATE TRIGGER refuse_release BEFORE UPDATE ON deferred_key FOR EACH ROW
		WHEN (OLD.business_key = 'b' AND OLD.leased_by IS NOT NULL AND NEW.leased_by IS NULL)
		EXECUTE FUNCTION refuse_release()`)

	// 101 bytes a message: within 150, a's two (the second starts below the
	// budget), and b and c come back empty.
	l, err := keylock.New(db.Pool, keylock.Config{Owner: "one", Lease: time.Minute, PerKey: 10, MaxBytes: 150})
	if err != nil {
		t.Fatal(err)
	}
	claims, err := l.Claim(ctx, 10)
	if err == nil || !strings.Contains(err.Error(), "injected: release of key b refused") {
		t.Fatalf("claim error = %v, want the refused release", err)
	}
	if got, want := claimSummary(t, claims), []string{"a:1,2"}; !slices.Equal(got, want) {
		t.Fatalf("claim returned %q with its error, want %q", got, want)
	}
	for _, k := range []string{"a", "b", "c"} {
		// The failed statement gave back neither cut key; a is the caller's.
		if l := leaseOf(t, db.Pool, k); l.By == nil || *l.By != "one" {
			t.Errorf("key %s: %s, want leased to one", k, l)
		}
	}

	// The caller publishes and finalizes what it got, as after any claim.
	if err := l.Finalize(ctx, claims, keylock.Outcome{Published: []int64{claims[0].Messages[0].ID, claims[0].Messages[1].ID}}); err != nil {
		t.Fatal(err)
	}
	if l := leaseOf(t, db.Pool, "a"); l.Found {
		t.Errorf("key a after its messages were published: %s, want no key row", l)
	}
	var left []string
	if err := db.Pool.QueryRow(ctx, `SELECT array_agg(business_key ORDER BY business_key) FROM deferred_message`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if want := []string{"b", "c"}; !slices.Equal(left, want) {
		t.Errorf("messages left: %q, want %q", left, want)
	}
}
