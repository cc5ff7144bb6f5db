package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/defer/ingest"
)

// TestReaperRemovesMemberKilledInJoin reproduces finding 2 of docs/chaos.md
// on kfake alone: a process killed while its JoinGroup is parked becomes a
// member of the next generation and is assigned a partition; kfake then
// often never removes it, so that partition is never read again although the
// live member is in the group, heartbeating. The reaper removes it once its
// session has expired, and the live member gets the partition back.
func TestReaperRemovesMemberKilledInJoin(t *testing.T) {
	const (
		group   = "reaper-test"
		topic   = "reaper.defer"
		session = 2 * time.Second
	)
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, topic), kfake.GroupMinSessionTimeout(session))
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	addr := kc.ListenAddrs()[0]
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	summary := func() string { return groupSummary(kc.GroupInfo(group), topic, 2, map[string]bool{"live": true}) }

	// The live member, configured as ingest is.
	conf := ingest.ConsumerConfig(kafkaConfig(), nil)
	conf.ClientID = "live"
	conf.Consumer.Group.Session.Timeout = session
	conf.Consumer.Group.Heartbeat.Interval = session / 4
	cg, err := sarama.NewConsumerGroup([]string{addr}, group, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	h := &recordingHandler{msgs: make(chan *sarama.ConsumerMessage, 16)}
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		for ctx.Err() == nil {
			if err := cg.Consume(ctx, []string{topic}, h); err != nil && ctx.Err() == nil {
				t.Logf("live member: session ended: %v", err)
				time.Sleep(100 * time.Millisecond)
			}
		}
	}()
	defer func() { cancel(); <-consumed }()
	h.waitClaims(t, ctx, []int32{0, 1})

	// Whether kfake keeps the dead member is a coin toss (see reaper: its
	// reply to the dead connection may or may not arm the session timer),
	// so kill joiners until one is kept.
	gone := map[string]time.Time{}
	var stuck string
	for attempt := 1; attempt <= 8 && stuck == ""; attempt++ {
		client := fmt.Sprintf("dead-%d", attempt)
		dead, diedAt := joinAndDie(t, kc, addr, group, topic, client, session)
		gone[client] = diedAt
		// kfake completes the rebalance with the dead member and the
		// leader (the live member) gives it a partition.
		wctx, stop := context.WithTimeout(ctx, 15*time.Second)
		_, err := kc.WaitGroupInfo(wctx, group, func(g *kfake.GroupInfo) bool {
			return g != nil && g.State == "Stable" && slices.ContainsFunc(g.Members, func(m kfake.GroupMember) bool {
				return m.MemberID == dead && m.NumAssigned() > 0
			})
		})
		stop()
		if err != nil {
			t.Logf("the dead member %s got no partition (%v): %s; again", dead, err, summary())
			h.waitClaims(t, ctx, []int32{0, 1})
			continue
		}
		t.Logf("dead member in the group: %s", summary())
		time.Sleep(2 * session)
		if slices.ContainsFunc(kc.GroupInfo(group).Members, func(m kfake.GroupMember) bool { return m.MemberID == dead }) {
			stuck = dead
			break
		}
		t.Logf("kfake removed %s after its session timeout this time; again", dead)
		h.waitClaims(t, ctx, []int32{0, 1})
	}
	if stuck == "" {
		// kfake now expires such members itself: the reaper has
		// nothing to do and may go.
		t.Skip("kfake removed every dead member by itself")
	}
	t.Logf("two session timeouts after: %s", summary())
	if got := h.claims(); len(got) != 1 {
		t.Fatalf("live member claims %v, want one partition: kfake kept the dead member", got)
	}

	r := &reaper{kc: kc, addr: addr, group: group, session: session, rebalance: conf.Consumer.Group.Rebalance.Timeout, say: t.Logf,
		gone: func() map[string]time.Time { return gone }}
	reaped := make(chan int)
	rctx, stopReaper := context.WithCancel(ctx)
	go func() { reaped <- r.run(rctx, 100*time.Millisecond) }()
	h.waitClaims(t, ctx, []int32{0, 1})
	stopReaper()
	if n := <-reaped; n != 1 {
		t.Errorf("reaper removed %d members, want 1", n)
	}

	// Both partitions are read again.
	p, err := sarama.NewSyncProducer([]string{addr}, func() *sarama.Config {
		c := kafkaConfig()
		c.Producer.Return.Successes = true
		c.Producer.Partitioner = sarama.NewManualPartitioner
		return c
	}())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for part := range int32(2) {
		if _, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: topic, Partition: part, Value: sarama.StringEncoder("x")}); err != nil {
			t.Fatal(err)
		}
	}
	read := map[int32]bool{}
	for len(read) < 2 {
		select {
		case m := <-h.msgs:
			read[m.Partition] = true
		case <-ctx.Done():
			t.Fatalf("read from partitions %v only", read)
		}
	}
}

// joinAndDie joins group as a consumer with client ID client and closes its
// connection while its second JoinGroup (the one with the member ID, KIP-394)
// is parked at the coordinator, waiting for the other members to rejoin: what
// a process SIGKILLed at that moment leaves behind. It returns the member ID
// and when the connection was closed.
func joinAndDie(t *testing.T, kc *kfake.Cluster, addr, group, topic, client string, session time.Duration) (string, time.Time) {
	t.Helper()
	conf := kafkaConfig()
	conf.ClientID = client
	// Closing the socket under the client is what a SIGKILL does;
	// Broker.Close would wait for the parked JoinGroup to be answered.
	d := &connDialer{}
	conf.Net.Proxy.Enable, conf.Net.Proxy.Dialer = true, d
	b := sarama.NewBroker(addr)
	if err := b.Open(conf); err != nil {
		t.Fatal(err)
	}
	join := func(member string) *sarama.JoinGroupRequest {
		req := sarama.NewJoinGroupRequest(conf.Version)
		req.GroupId, req.MemberId, req.ProtocolType = group, member, "consumer"
		req.SessionTimeout = int32(session / time.Millisecond)
		req.RebalanceTimeout = int32(20 * time.Second / time.Millisecond)
		if err := req.AddGroupProtocolMetadata(sarama.StickyBalanceStrategyName,
			&sarama.ConsumerGroupMemberMetadata{Version: 1, Topics: []string{topic}}); err != nil {
			t.Fatal(err)
		}
		return req
	}
	resp, err := b.JoinGroup(join(""))
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(resp.Err, sarama.ErrMemberIdRequired) {
		t.Fatalf("first JoinGroup: %v, want %v", resp.Err, sarama.ErrMemberIdRequired)
	}
	member := resp.MemberId
	go func() { _, _ = b.JoinGroup(join(member)) }() // parked until the rebalance completes
	deadline := time.Now().Add(10 * time.Second)
	for {
		info := kc.GroupInfo(group)
		if info != nil && slices.ContainsFunc(info.Members, func(m kfake.GroupMember) bool { return m.MemberID == member }) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second JoinGroup of %s never reached the group", member)
		}
		time.Sleep(time.Millisecond)
	}
	d.closeAll()
	diedAt := time.Now()
	_ = b.Close()
	return member, diedAt
}

// connDialer dials TCP and keeps the connections, so that a test can close
// them under the client.
type connDialer struct {
	mu    sync.Mutex
	conns []net.Conn
}

func (d *connDialer) Dial(network, addr string) (net.Conn, error) {
	c, err := net.Dial(network, addr)
	if err == nil {
		d.mu.Lock()
		d.conns = append(d.conns, c)
		d.mu.Unlock()
	}
	return c, err
}

func (d *connDialer) closeAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns {
		_ = c.Close()
	}
}

// recordingHandler remembers the claims of the current session and passes
// on the messages it reads.
type recordingHandler struct {
	mu   sync.Mutex
	cur  []int32
	msgs chan *sarama.ConsumerMessage
}

func (h *recordingHandler) Setup(s sarama.ConsumerGroupSession) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, ps := range s.Claims() {
		h.cur = append([]int32(nil), ps...)
	}
	return nil
}

func (h *recordingHandler) Cleanup(sarama.ConsumerGroupSession) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.cur = nil
	return nil
}

func (h *recordingHandler) ConsumeClaim(s sarama.ConsumerGroupSession, c sarama.ConsumerGroupClaim) error {
	for {
		select {
		case m, ok := <-c.Messages():
			if !ok {
				return nil
			}
			h.msgs <- m
		case <-s.Context().Done():
			return nil
		}
	}
}

func (h *recordingHandler) claims() []int32 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Sorted(slices.Values(h.cur))
}

func (h *recordingHandler) waitClaims(t *testing.T, ctx context.Context, want []int32) {
	t.Helper()
	for !slices.Equal(h.claims(), want) {
		select {
		case <-ctx.Done():
			t.Fatalf("live member claims %v, want %v", h.claims(), want)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
