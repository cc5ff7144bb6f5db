package gate_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/deferq/scheduler/deferclient/gate"
)

// A record of business key "order-42" goes to the same partition of the
// defer topic and of the retry topic, whatever its record key: the one the
// Java client's default partitioner gives the key's bytes.
func ExamplePartition() {
	fmt.Println(gate.Partition("order-42", 12))
	fmt.Println(gate.Partition("order-43", 12))
	// Output:
	// 0
	// 10
}

// Errors marked Permanent are parked by the scheduler at once; any other
// error is classified by its innermost type, which NON_RETRIABLE_ERRORS
// patterns can match.
func ExampleDefaultClassify() {
	class, msg := gate.DefaultClassify(gate.Permanent(errors.New("card declined")))
	fmt.Println(class, "|", msg)
	class, msg = gate.DefaultClassify(fmt.Errorf("charge: %w", context.DeadlineExceeded))
	fmt.Println(class, "|", msg)
	// Output:
	// permanent | card declined
	// context.deadlineExceededError | charge: context deadline exceeded
}

// A record's business key is its defer.key header when it has one (the
// scheduler republished it, or its producer named one), else its record
// key.
func ExampleBusinessKey() {
	fmt.Println(gate.BusinessKey(gate.Record{Key: []byte("order-7")}))
	fmt.Println(gate.BusinessKey(gate.Record{Key: []byte("rec-1"),
		Headers: []gate.Header{{Key: "defer.key", Value: []byte("order-42")}}}))
	// Output:
	// order-7
	// order-42
}
