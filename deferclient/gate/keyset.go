package gate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/deferq/scheduler/internal/keystate"
)

// The blocked-key set (docs/design.md, "The blocked-key set"): rather than
// ask the scheduler about the keys of every batch, the gate loads its
// group's blocked keys at every assignment and follows what changes, so
// that a main-topic record of a key that is not blocked costs a map lookup
// here and nothing in the scheduler's database.
const (
	// feedEvery is how often the gate asks what changed.
	feedEvery = 200 * time.Millisecond
	// staleAfter: with no answer of the feed sent within it, or changes
	// held back longer than it (behind_ms), the set is not trusted and
	// batches ask about their keys, as without a set.
	staleAfter = 2 * time.Second
)

// keySet is the gate's copy of its group's blocked keys.
type keySet struct {
	// fetch is held across a whole load or feed question, request
	// included: answers are applied in the order of the snapshots they
	// were read at, so that a load cannot put back a state older than
	// what a feed answer already put in the set (and forgot a local
	// deferral for).
	fetch sync.Mutex
	mu    sync.Mutex
	// keys holds the blocked keys, each with its state.
	keys map[string]KeyState
	// cursor is where the feed goes on from; "" before the first load.
	cursor string
	// assigned counts the assignments the adapter reported (Assigned);
	// loaded is the last one whose load waited for all of the defer topic
	// and succeeded: a claim of an assignment after it cannot trust the
	// set, whose keys may lack its predecessor's deferrals.
	assigned, loaded uint64
	// current is when the request of the last answer that brought the set
	// up to date was sent; behind, that the answer said changes were held
	// back longer than staleAfter.
	current time.Time
	behind  bool
	// unsupported: the scheduler serves no set (an older release): the
	// gate asks about every batch, as it did.
	unsupported bool
	// following: the feed's goroutine runs; stop ends it.
	following bool
	stop      chan struct{}
	done      chan struct{}
}

// Assigned tells the gate that the adapter's consumer was assigned
// partitions. It loads the group's blocked keys, waiting until the
// scheduler has stored everything produced to the defer topic before the
// call, so that the set holds the deferrals of the partitions' previous
// owners, and starts following the set's changes. Batches of claims made
// after this call trust the set only once such a load succeeded; until
// then they ask the scheduler about their keys, and a load that failed is
// tried again. An error says why the set is not usable yet.
func (g *Gate) Assigned(ctx context.Context) error {
	g.set.mu.Lock()
	g.set.assigned++
	gen := g.set.assigned
	g.set.mu.Unlock()
	err := g.load(ctx, gen, true)
	if err != nil {
		g.count(func(s *Stats) { s.FeedFailures++ })
	}
	g.follow()
	return err
}

// Close stops following the set. The Gate still answers, by asking.
func (g *Gate) Close() {
	g.set.mu.Lock()
	stop, done := g.set.stop, g.set.done
	g.set.following, g.set.stop, g.set.done = false, nil, nil
	g.set.mu.Unlock()
	if stop != nil {
		close(stop)
		<-done
	}
}

// follow starts the feed's goroutine unless it runs.
func (g *Gate) follow() {
	g.set.mu.Lock()
	defer g.set.mu.Unlock()
	if g.set.following || g.set.unsupported {
		return
	}
	g.set.following = true
	g.set.stop, g.set.done = make(chan struct{}), make(chan struct{})
	go g.feed(g.set.stop, g.set.done)
}

// feed keeps the set current until stop closes: every feedEvery it asks
// what changed, and loads the set again when the answer says to, or when
// the last assignment's load failed.
func (g *Gate) feed(stop, done chan struct{}) {
	defer close(done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-stop
		cancel()
	}()
	t := time.NewTicker(feedEvery)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		g.set.mu.Lock()
		gen, retry, cursor := g.set.assigned, g.set.loaded < g.set.assigned, g.set.cursor
		g.set.mu.Unlock()
		var err error
		switch {
		case retry:
			err = g.load(ctx, gen, true)
		case cursor == "":
			err = g.load(ctx, gen, false)
		default:
			err = g.changes(ctx, cursor)
		}
		if err != nil && ctx.Err() == nil {
			g.count(func(s *Stats) { s.FeedFailures++ })
		}
	}
}

// load reads the whole set, page by page, for assignment gen; waitAll
// makes the first page wait for ingest to store the defer topic.
func (g *Gate) load(ctx context.Context, gen uint64, waitAll bool) error {
	g.set.fetch.Lock()
	defer g.set.fetch.Unlock()
	sent := time.Now()
	keys := map[string]KeyState{}
	req := keystate.SetRequest{Group: g.cfg.Group, WaitMillis: int(g.cfg.KeyStateWait.Milliseconds())}
	if !waitAll {
		req.Wait, req.WaitMillis = keystate.WaitPositions, 0
	}
	cursor := ""
	for {
		var page keystate.SetResponse
		if err := g.call(ctx, keystate.SetPath, req, &page); err != nil {
			return fmt.Errorf("deferclient: load the blocked keys of group %q: %w", g.cfg.Group, err)
		}
		if cursor == "" {
			cursor = page.Cursor
		}
		for _, st := range page.Keys {
			keys[st.Key] = KeyState{Blocked: st.Blocked, Reason: st.Reason, HeadSeq: st.HeadSeq}
		}
		if page.Next == "" {
			break
		}
		req = keystate.SetRequest{Group: g.cfg.Group, After: page.Next}
	}
	g.set.mu.Lock()
	defer g.set.mu.Unlock()
	g.set.keys, g.set.cursor, g.set.current, g.set.behind = keys, cursor, sent, false
	if waitAll && gen > g.set.loaded {
		g.set.loaded = gen
	}
	g.count(func(s *Stats) { s.SetLoads++ })
	return nil
}

// changes applies what changed since cursor, asking besides about this
// process's own deferrals the scheduler may not have confirmed, with where
// each went: the scheduler answers for one once ingest stored past it, and
// the key's state then replaces it.
func (g *Gate) changes(ctx context.Context, cursor string) error {
	g.set.fetch.Lock()
	defer g.set.fetch.Unlock()
	sent := time.Now()
	g.pendingMu.Lock()
	own := slices.Sorted(maps.Keys(g.pending))
	if len(own) > keystate.MaxKeys {
		own = own[:keystate.MaxKeys] // the rest next time
	}
	positions := make([]keystate.Position, len(own))
	for i, k := range own {
		positions[i] = keystate.Position{Partition: g.pending[k].partition, Offset: g.pending[k].offset}
	}
	g.pendingMu.Unlock()
	var resp keystate.ChangesResponse
	req := keystate.ChangesRequest{Group: g.cfg.Group, Cursor: cursor, Keys: own, Positions: positions}
	if err := g.call(ctx, keystate.ChangesPath, req, &resp); err != nil {
		return fmt.Errorf("deferclient: changes of the blocked keys of group %q: %w", g.cfg.Group, err)
	}
	g.count(func(s *Stats) { s.FeedPolls++ })
	if resp.Reset {
		g.set.mu.Lock()
		g.set.cursor = "" // load again, at the next tick
		g.set.mu.Unlock()
		return nil
	}
	g.set.mu.Lock()
	if g.set.cursor != cursor {
		// Loaded meanwhile, from a later moment.
		g.set.mu.Unlock()
		return nil
	}
	for _, st := range resp.Keys {
		if st.Blocked {
			g.set.keys[st.Key] = KeyState{Blocked: true, Reason: st.Reason, HeadSeq: st.HeadSeq}
		} else {
			delete(g.set.keys, st.Key)
		}
	}
	g.set.cursor, g.set.current = resp.Cursor, sent
	g.set.behind = time.Duration(resp.BehindMillis)*time.Millisecond > staleAfter
	g.set.mu.Unlock()

	// Forgotten only after the set holds what the answer said of the key.
	g.pendingMu.Lock()
	defer g.pendingMu.Unlock()
	for _, k := range own {
		if local, ok := g.pending[k]; ok {
			if next, ok := resp.Stored[local.partition]; ok && next > local.offset {
				delete(g.pending, k)
			}
		}
	}
	return nil
}

// setStates returns the state of keys from the set, this process's own
// deferrals merged in, when a batch of claim may trust it (a key missing
// from the map is free): it was loaded,
// waiting for all, after the claim's assignment, and is current.
func (g *Gate) setStates(keys []string, claim *ClaimState) (map[string]KeyState, bool) {
	g.set.mu.Lock()
	if claim.gen == 0 {
		claim.gen = g.set.assigned
	}
	if g.set.unsupported || g.set.cursor == "" || g.set.loaded < claim.gen || claim.gen == 0 ||
		g.set.behind || time.Since(g.set.current) > staleAfter {
		g.set.mu.Unlock()
		return nil, false
	}
	g.set.mu.Unlock()
	// Own deferrals first, then the set: the feed puts a key's state in
	// the set before it forgets the deferral, so one of the two reads has
	// it whenever the feed runs between them.
	var own map[string]int64
	g.pendingMu.Lock()
	if len(g.pending) > 0 {
		for _, k := range keys {
			if local, ok := g.pending[k]; ok {
				if own == nil {
					own = map[string]int64{}
				}
				own[k] = local.seq
			}
		}
	}
	g.pendingMu.Unlock()
	// Only blocked keys go in: a key missing from the map is free, and
	// most keys of a batch are.
	states := map[string]KeyState{}
	g.set.mu.Lock()
	for _, k := range keys {
		if st, ok := g.set.keys[k]; ok {
			states[k] = st
		}
	}
	g.set.mu.Unlock()
	for k, seq := range own {
		states[k] = block(states[k], seq)
	}
	return states, true
}

// errUnsupported: the scheduler serves no blocked-key set.
var errUnsupported = errors.New("the scheduler serves no blocked-key set (a release before it): asking about every batch")

// call posts req as JSON to path on each scheduler URL in turn until one
// answers, and decodes the answer into resp: a replica that is down or
// cannot vouch for its answer (5xx) says nothing about the others, which
// share its database.
func (g *Gate) call(ctx context.Context, path string, req, resp any) error {
	if len(g.urls) == 0 || g.cfg.Group == "" {
		return errors.New("no SchedulerURL or no Group is configured")
	}
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	first := int(g.next.Add(1)) % len(g.urls)
	var errs []error
	for i := range g.urls {
		u := g.urls[(first+i)%len(g.urls)]
		raw, status, err := g.post(ctx, u+path, body)
		if err == nil {
			if err := json.Unmarshal(raw, resp); err != nil {
				return fmt.Errorf("%s: the scheduler's answer is not the JSON expected: %w", u, err)
			}
			return nil
		}
		if status == http.StatusNotFound && path != keystate.Path {
			g.set.mu.Lock()
			g.set.unsupported = true
			g.set.mu.Unlock()
			return errUnsupported
		}
		errs = append(errs, fmt.Errorf("%s: %w", u, err))
		if (status != 0 && status < 500) || ctx.Err() != nil {
			break
		}
	}
	return errors.Join(errs...)
}

// post sends one signed request to url and returns the body of a 200
// answer; otherwise the status (0 when there was none) and an error that
// says what the scheduler said.
func (g *Gate) post(ctx context.Context, url string, body []byte) ([]byte, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	if len(g.cfg.SourceKey) > 0 {
		ts := time.Now().Unix()
		req.Header.Set(keystate.HeaderSource, g.cfg.Source)
		req.Header.Set(keystate.HeaderTimestamp, strconv.FormatInt(ts, 10))
		req.Header.Set(keystate.HeaderSignature, keystate.Sign(g.cfg.SourceKey, ts, body))
	}
	resp, err := g.http.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, 0, err
	}
	if resp.StatusCode != http.StatusOK {
		var e keystate.ErrorResponse
		if json.Unmarshal(raw, &e) == nil && e.Error != "" {
			return nil, resp.StatusCode, fmt.Errorf("%s: %s", resp.Status, e.Error)
		}
		return nil, resp.StatusCode, fmt.Errorf("%s", resp.Status)
	}
	return raw, resp.StatusCode, nil
}
