package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
)

// The defer topic deleted and created again (a cluster migration, an
// operator's mistake) reuses offsets. Every record produced to the new topic
// is delivered, none taken for an old one stored at the same offset, whether
// the scheduler runs through the re-creation or starts after it. More
// records go to the new topic than the old one had, so that the high-water
// marks do not tell: only the topic id does.
func TestDeferTopicRecreated(t *testing.T) {
	for _, restart := range []bool{false, true} {
		name := "running through it"
		if restart {
			name = "restarted after it"
		}
		t.Run(name, func(t *testing.T) {
			brokers := broker(t)
			db, _ := emptyDB(t)
			env := serviceEnv(db, brokers, "e2e-recreated")
			p := start(t, env, "--migrate")
			out := read(t, brokers, targetTopic)
			prod := producer(t, brokers)
			send := func(prod sarama.SyncProducer, prefix string, n int) []string {
				values := make([]string, n)
				for i := range n {
					values[i] = fmt.Sprintf("%s-%d", prefix, i)
					if _, _, err := prod.SendMessage(deferRecord(values[i], values[i],
						"defer.target", targetTopic, "defer.delay", "0")); err != nil {
						t.Fatalf("produce %s: %v", values[i], err)
					}
				}
				return values
			}
			old := send(prod, "old", 20)
			out.until(t, 30*time.Second, "the old topic's records delivered", deliveredAll(old))
			if restart {
				p.stop()
			}

			c := sarama.NewConfig()
			c.Version = sarama.V3_6_0_0
			admin, err := sarama.NewClusterAdmin([]string{brokers}, c)
			if err != nil {
				t.Fatal(err)
			}
			defer admin.Close()
			if err := admin.DeleteTopic(deferTopic); err != nil {
				t.Fatal(err)
			}
			waitUntil(t, 10*time.Second, "the defer topic deleted", func() (bool, string) {
				topics, err := admin.ListTopics()
				_, ok := topics[deferTopic]
				return err == nil && !ok, fmt.Sprint(err)
			})
			if err := admin.CreateTopic(deferTopic, &sarama.TopicDetail{NumPartitions: 4, ReplicationFactor: 1}, false); err != nil {
				t.Fatal(err)
			}
			// The idempotent producer's sequence numbers belong to the old
			// topic: producers of the new one start afresh, as theirs would.
			fresh := send(producer(t, brokers), "new", 60)
			if restart {
				p = start(t, env)
			}
			got := out.until(t, 60*time.Second, "every record of the new topic delivered", deliveredAll(old, fresh))
			if n := len(got); n < len(old)+len(fresh) {
				t.Errorf("%d deliveries, want at least %d", n, len(old)+len(fresh))
			}
			if logs := p.Logs(); !strings.Contains(logs, "partition was re-created or truncated") {
				t.Errorf("no log line says the partitions were re-created:\n%s", logs)
			}
			p.stop()
		})
	}
}
